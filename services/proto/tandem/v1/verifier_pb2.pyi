from services.proto.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaCommands(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[ReplicaRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[ReplicaRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "params", "logprobs", "category", "trace_context", "top_logprobs", "output_tokens", "final_only")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    logprobs: bool
    category: str
    trace_context: _containers.ScalarMap[str, str]
    top_logprobs: int
    output_tokens: int
    final_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., category: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., top_logprobs: _Optional[int] = ..., output_tokens: _Optional[int] = ..., final_only: _Optional[bool] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("num_steps", "num_emitted", "num_drafted", "num_accepted", "drafted_per_pos", "accepted_per_pos")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_emitted: int
    num_drafted: int
    num_accepted: int
    drafted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_steps: _Optional[int] = ..., num_emitted: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., drafted_per_pos: _Optional[_Iterable[int]] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaEvents(_message.Message):
    __slots__ = ("events", "deltas")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ReplicaEvent]
    deltas: StepDeltas
    def __init__(self, events: _Optional[_Iterable[_Union[ReplicaEvent, _Mapping]]] = ..., deltas: _Optional[_Union[StepDeltas, _Mapping]] = ...) -> None: ...

class StepDeltas(_message.Message):
    __slots__ = ("request_ids", "num_tokens", "token_ids", "texts")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaEvent(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "token_texts", "finished", "finish_reason", "stop_string", "stop_token_id", "spec", "error", "invalid", "top_logprobs", "since_first_token_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    finished: bool
    finish_reason: str
    stop_string: str
    stop_token_id: int
    spec: SpecStats
    error: str
    invalid: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    since_first_token_s: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_texts: _Optional[_Iterable[str]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., error: _Optional[str] = ..., invalid: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., since_first_token_s: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("draft_width", "acceptance_threshold")
    DRAFT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    draft_width: int
    acceptance_threshold: float
    def __init__(self, draft_width: _Optional[int] = ..., acceptance_threshold: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_slots", "running", "waiting", "queued_prompt_tokens", "state_store", "drafter", "draft_limit", "draft_width", "threshold", "acceptance_threshold", "acceptance_threshold_set", "recent_drafted_per_pos", "recent_accepted_per_pos", "graphs_captured", "engine_steps", "engine_step_s", "engine_deliver_s", "engine_rounds", "engine_round_rows", "engine_prefills", "engine_prefill_s")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_STORE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_THRESHOLD_SET_FIELD_NUMBER: _ClassVar[int]
    RECENT_DRAFTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DELIVER_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ROUND_ROWS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    running: int
    waiting: int
    queued_prompt_tokens: int
    state_store: StateStoreStatus
    drafter: DrafterStatus
    draft_limit: int
    draft_width: int
    threshold: ThresholdState
    acceptance_threshold: float
    acceptance_threshold_set: bool
    recent_drafted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    recent_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    graphs_captured: int
    engine_steps: int
    engine_step_s: float
    engine_deliver_s: float
    engine_rounds: int
    engine_round_rows: int
    engine_prefills: int
    engine_prefill_s: float
    def __init__(self, num_slots: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., state_store: _Optional[_Union[StateStoreStatus, _Mapping]] = ..., drafter: _Optional[_Union[DrafterStatus, _Mapping]] = ..., draft_limit: _Optional[int] = ..., draft_width: _Optional[int] = ..., threshold: _Optional[_Union[ThresholdState, _Mapping]] = ..., acceptance_threshold: _Optional[float] = ..., acceptance_threshold_set: _Optional[bool] = ..., recent_drafted_per_pos: _Optional[_Iterable[int]] = ..., recent_accepted_per_pos: _Optional[_Iterable[int]] = ..., graphs_captured: _Optional[int] = ..., engine_steps: _Optional[int] = ..., engine_step_s: _Optional[float] = ..., engine_deliver_s: _Optional[float] = ..., engine_rounds: _Optional[int] = ..., engine_round_rows: _Optional[int] = ..., engine_prefills: _Optional[int] = ..., engine_prefill_s: _Optional[float] = ...) -> None: ...

class ThresholdState(_message.Message):
    __slots__ = ("grid", "rounds", "tokens", "ms")
    GRID_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    grid: _containers.RepeatedScalarFieldContainer[float]
    rounds: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[float]
    ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, grid: _Optional[_Iterable[float]] = ..., rounds: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[float]] = ..., ms: _Optional[_Iterable[float]] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("name", "address", "available")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    available: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., available: _Optional[bool] = ...) -> None: ...

class StateStoreStatus(_message.Message):
    __slots__ = ("backend", "up", "pending_writes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    up: bool
    pending_writes: int
    def __init__(self, backend: _Optional[str] = ..., up: _Optional[bool] = ..., pending_writes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("model", "vocab_size", "num_slots", "max_seq_len", "eos_token_ids", "cost", "speculation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    num_slots: int
    max_seq_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cost: _containers.RepeatedCompositeFieldContainer[CostPoint]
    speculation: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cost: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., speculation: _Optional[str] = ...) -> None: ...
