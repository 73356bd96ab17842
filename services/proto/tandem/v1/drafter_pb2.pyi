from services.proto.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftStreamRequest(_message.Message):
    __slots__ = ("draft", "release")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    draft: DraftRequestBatch
    release: ReleaseSequences
    def __init__(self, draft: _Optional[_Union[DraftRequestBatch, _Mapping]] = ..., release: _Optional[_Union[ReleaseSequences, _Mapping]] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("seq_id", "base_len", "tokens", "max_draft", "params")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    base_len: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_draft: int
    params: _common_pb2.SamplingParams
    def __init__(self, seq_id: _Optional[int] = ..., base_len: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., max_draft: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DraftRequestBatch(_message.Message):
    __slots__ = ("round", "sequences", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    round: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, round: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReleaseSequences(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("seq_id", "tokens", "probs", "features", "num_features", "top_tokens", "top_m", "scores")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NUM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_M_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseProbs]
    features: _containers.RepeatedScalarFieldContainer[float]
    num_features: int
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_m: int
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.SparseProbs, _Mapping]]] = ..., features: _Optional[_Iterable[float]] = ..., num_features: _Optional[int] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_m: _Optional[int] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("round", "proposals")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    def __init__(self, round: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("name", "num_features", "max_sequences", "max_probs_per_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROBS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_features: int
    max_sequences: int
    max_probs_per_token: int
    def __init__(self, name: _Optional[str] = ..., num_features: _Optional[int] = ..., max_sequences: _Optional[int] = ..., max_probs_per_token: _Optional[int] = ...) -> None: ...
