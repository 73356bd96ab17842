from services.proto.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_ids", "params", "return_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    return_logprobs: bool
    def __init__(self, seq_id: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ...) -> None: ...

class VerifySequence(_message.Message):
    __slots__ = ("seq_id", "last_token", "draft_tokens", "draft_probs", "parents", "is_tree", "return_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    IS_TREE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    last_token: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseProbs]
    parents: _containers.RepeatedScalarFieldContainer[int]
    is_tree: bool
    return_logprobs: bool
    def __init__(self, seq_id: _Optional[int] = ..., last_token: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseProbs, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ..., is_tree: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("batch_id", "release", "prefill", "verify", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    release: _containers.RepeatedScalarFieldContainer[int]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillSequence]
    verify: _containers.RepeatedCompositeFieldContainer[VerifySequence]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, batch_id: _Optional[int] = ..., release: _Optional[_Iterable[int]] = ..., prefill: _Optional[_Iterable[_Union[PrefillSequence, _Mapping]]] = ..., verify: _Optional[_Iterable[_Union[VerifySequence, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("seq_id", "tokens", "num_accepted", "logprobs", "extras")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    extras: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., extras: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("batch_id", "prefill", "verify", "prefill_refused")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REFUSED_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    prefill: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    verify: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    prefill_refused: bool
    def __init__(self, batch_id: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., verify: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., prefill_refused: _Optional[bool] = ...) -> None: ...

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("batch_size", "tokens_per_sequence", "ms")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    tokens_per_sequence: int
    ms: float
    def __init__(self, batch_size: _Optional[int] = ..., tokens_per_sequence: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "num_slots", "max_seq_len", "eos_token_ids", "cost")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    num_slots: int
    max_seq_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cost: _containers.RepeatedCompositeFieldContainer[CostPoint]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cost: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ...) -> None: ...
