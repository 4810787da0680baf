from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ...) -> None: ...

class ProbRow(_message.Message):
    __slots__ = ("vocab_size", "indices", "values")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    indices: bytes
    values: bytes
    def __init__(self, vocab_size: _Optional[int] = ..., indices: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "threads", "constraint", "prompt_length", "vocab_size", "history_scope", "reproducible", "prediction_token_ids", "reserve_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REPRODUCIBLE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    constraint: Constraint
    prompt_length: int
    vocab_size: int
    history_scope: str
    reproducible: bool
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reserve_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., prompt_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., history_scope: _Optional[str] = ..., reproducible: _Optional[bool] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "expected_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_length: int
    def __init__(self, session_id: _Optional[str] = ..., expected_length: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session", "append_tokens", "k", "sampling", "uniforms", "assumed_tokens", "noise_seed", "tree_nodes", "tree_acceptance", "threads", "alternatives", "free_lookahead")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOISE_SEED_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    FREE_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: SamplingParams
    uniforms: _containers.RepeatedScalarFieldContainer[float]
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    noise_seed: int
    tree_nodes: int
    tree_acceptance: _containers.RepeatedScalarFieldContainer[float]
    threads: int
    alternatives: bool
    free_lookahead: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., append_tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., uniforms: _Optional[_Iterable[float]] = ..., assumed_tokens: _Optional[_Iterable[int]] = ..., noise_seed: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., tree_acceptance: _Optional[_Iterable[float]] = ..., threads: _Optional[int] = ..., alternatives: _Optional[bool] = ..., free_lookahead: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "token_probs", "length", "compute_seconds", "steps", "step_tokens", "parent_ids", "node_rows", "row_nodes", "threads", "forward_seconds", "runner_up_ids", "top_probs", "runner_up_probs", "mask_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_NODES_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_PROBS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_PROBS_FIELD_NUMBER: _ClassVar[int]
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    length: int
    compute_seconds: float
    steps: int
    step_tokens: int
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    node_rows: _containers.RepeatedCompositeFieldContainer[ProbRow]
    row_nodes: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    forward_seconds: float
    runner_up_ids: _containers.RepeatedScalarFieldContainer[int]
    top_probs: _containers.RepeatedScalarFieldContainer[float]
    runner_up_probs: _containers.RepeatedScalarFieldContainer[float]
    mask_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_probs: _Optional[_Iterable[float]] = ..., length: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., steps: _Optional[int] = ..., step_tokens: _Optional[int] = ..., parent_ids: _Optional[_Iterable[int]] = ..., node_rows: _Optional[_Iterable[_Union[ProbRow, _Mapping]]] = ..., row_nodes: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., runner_up_ids: _Optional[_Iterable[int]] = ..., top_probs: _Optional[_Iterable[float]] = ..., runner_up_probs: _Optional[_Iterable[float]] = ..., mask_seconds: _Optional[float] = ...) -> None: ...

class ProposalRowRequest(_message.Message):
    __slots__ = ("session", "position", "token_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    position: int
    token_id: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("session", "append_tokens", "draft_token_ids", "sampling", "draft_token_probs", "accept_uniforms", "noise_seed", "draft_parent_ids", "draft_rows", "draft_row_nodes", "final_uniform", "threads", "logprobs", "decode_steps", "stop_token_ids", "step_uniforms", "close_session")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    NOISE_SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROW_NODES_FIELD_NUMBER: _ClassVar[int]
    FINAL_UNIFORM_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    draft_token_probs: _containers.RepeatedScalarFieldContainer[float]
    accept_uniforms: _containers.RepeatedScalarFieldContainer[float]
    noise_seed: int
    draft_parent_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_rows: _containers.RepeatedCompositeFieldContainer[ProbRow]
    draft_row_nodes: _containers.RepeatedScalarFieldContainer[int]
    final_uniform: float
    threads: int
    logprobs: int
    decode_steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    step_uniforms: _containers.RepeatedScalarFieldContainer[float]
    close_session: bool
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., append_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., draft_token_probs: _Optional[_Iterable[float]] = ..., accept_uniforms: _Optional[_Iterable[float]] = ..., noise_seed: _Optional[int] = ..., draft_parent_ids: _Optional[_Iterable[int]] = ..., draft_rows: _Optional[_Iterable[_Union[ProbRow, _Mapping]]] = ..., draft_row_nodes: _Optional[_Iterable[int]] = ..., final_uniform: _Optional[float] = ..., threads: _Optional[int] = ..., logprobs: _Optional[int] = ..., decode_steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., step_uniforms: _Optional[_Iterable[float]] = ..., close_session: _Optional[bool] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("own_token", "own_logprob", "top_ids", "top_logprobs")
    OWN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    own_token: int
    own_logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, own_token: _Optional[int] = ..., own_logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("argmax_token_ids", "draft_token_target_probs", "row_position", "row", "length", "compute_seconds", "step_tokens", "step_sessions", "accepted_nodes", "final_token", "threads", "forward_seconds", "mask_seconds", "draft_token_logprobs", "row_logprobs", "final_token_logprob")
    ARGMAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    ROW_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    FINAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINAL_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    argmax_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_target_probs: _containers.RepeatedScalarFieldContainer[float]
    row_position: int
    row: ProbRow
    length: int
    compute_seconds: float
    step_tokens: int
    step_sessions: int
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    final_token: int
    threads: int
    forward_seconds: float
    mask_seconds: float
    draft_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    row_logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    final_token_logprob: float
    def __init__(self, argmax_token_ids: _Optional[_Iterable[int]] = ..., draft_token_target_probs: _Optional[_Iterable[float]] = ..., row_position: _Optional[int] = ..., row: _Optional[_Union[ProbRow, _Mapping]] = ..., length: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., step_tokens: _Optional[int] = ..., step_sessions: _Optional[int] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., final_token: _Optional[int] = ..., threads: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., mask_seconds: _Optional[float] = ..., draft_token_logprobs: _Optional[_Iterable[float]] = ..., row_logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., final_token_logprob: _Optional[float] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session", "token_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("session_id", "to_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    to_length: int
    def __init__(self, session_id: _Optional[str] = ..., to_length: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("length", "cached_length", "token_ids")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    length: int
    cached_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, length: _Optional[int] = ..., cached_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_digest", "max_context", "dtype", "device", "eos_token_ids", "role", "open_sessions", "max_sessions", "kv_tokens", "cpus", "threads", "backend", "step_costs", "machine", "device_id", "static_forwards", "builds_after_ready", "tree_verify", "prefix_cache", "index_drafts")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STATIC_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    BUILDS_AFTER_READY_FIELD_NUMBER: _ClassVar[int]
    TREE_VERIFY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    INDEX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_digest: str
    max_context: int
    dtype: str
    device: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    role: str
    open_sessions: int
    max_sessions: int
    kv_tokens: int
    cpus: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    backend: str
    step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    machine: str
    device_id: str
    static_forwards: StaticForwards
    builds_after_ready: int
    tree_verify: bool
    prefix_cache: PrefixCache
    index_drafts: bool
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ..., open_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., cpus: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ..., backend: _Optional[str] = ..., step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., machine: _Optional[str] = ..., device_id: _Optional[str] = ..., static_forwards: _Optional[_Union[StaticForwards, _Mapping]] = ..., builds_after_ready: _Optional[int] = ..., tree_verify: _Optional[bool] = ..., prefix_cache: _Optional[_Union[PrefixCache, _Mapping]] = ..., index_drafts: _Optional[bool] = ...) -> None: ...

class PrefixCache(_message.Message):
    __slots__ = ("prompt_tokens", "hit_tokens", "hits", "copied_tokens", "kept", "kept_tokens", "evictions", "block_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    COPIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    hit_tokens: int
    hits: int
    copied_tokens: int
    kept: int
    kept_tokens: int
    evictions: int
    block_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., hits: _Optional[int] = ..., copied_tokens: _Optional[int] = ..., kept: _Optional[int] = ..., kept_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class StaticForwards(_message.Message):
    __slots__ = ("mode", "batches", "widths", "lengths", "built", "seconds", "slots", "capacity", "kv_bytes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    BUILT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    batches: _containers.RepeatedScalarFieldContainer[int]
    widths: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    built: int
    seconds: float
    slots: int
    capacity: int
    kv_bytes: int
    def __init__(self, mode: _Optional[str] = ..., batches: _Optional[_Iterable[int]] = ..., widths: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., built: _Optional[int] = ..., seconds: _Optional[float] = ..., slots: _Optional[int] = ..., capacity: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("sessions", "seconds", "tokens", "threads")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    seconds: float
    tokens: int
    threads: int
    def __init__(self, sessions: _Optional[int] = ..., seconds: _Optional[float] = ..., tokens: _Optional[int] = ..., threads: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    def __init__(self, files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ...) -> None: ...

class StepCall(_message.Message):
    __slots__ = ("id", "timeout", "cancel", "trace", "propose", "score", "proposal_row", "open_session", "close_session")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ROW_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSION_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    id: int
    timeout: float
    cancel: bool
    trace: _containers.ScalarMap[str, str]
    propose: ProposeRequest
    score: ScoreRequest
    proposal_row: ProposalRowRequest
    open_session: OpenSessionRequest
    close_session: CloseSessionRequest
    def __init__(self, id: _Optional[int] = ..., timeout: _Optional[float] = ..., cancel: _Optional[bool] = ..., trace: _Optional[_Mapping[str, str]] = ..., propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., score: _Optional[_Union[ScoreRequest, _Mapping]] = ..., proposal_row: _Optional[_Union[ProposalRowRequest, _Mapping]] = ..., open_session: _Optional[_Union[OpenSessionRequest, _Mapping]] = ..., close_session: _Optional[_Union[CloseSessionRequest, _Mapping]] = ...) -> None: ...

class StepCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[StepCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[StepCall, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("id", "code", "details", "server_seconds", "propose", "score", "proposal_row", "open_session", "close_session")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ROW_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSION_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    details: str
    server_seconds: float
    propose: ProposeResponse
    score: ScoreResponse
    proposal_row: ProbRow
    open_session: OpenSessionResponse
    close_session: Empty
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., server_seconds: _Optional[float] = ..., propose: _Optional[_Union[ProposeResponse, _Mapping]] = ..., score: _Optional[_Union[ScoreResponse, _Mapping]] = ..., proposal_row: _Optional[_Union[ProbRow, _Mapping]] = ..., open_session: _Optional[_Union[OpenSessionResponse, _Mapping]] = ..., close_session: _Optional[_Union[Empty, _Mapping]] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
