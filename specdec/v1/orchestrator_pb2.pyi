from specdec.v1 import model_pb2 as _model_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Rule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RULE_UNSPECIFIED: _ClassVar[Rule]
    RULE_LEVIATHAN: _ClassVar[Rule]
    RULE_INVARIANT: _ClassVar[Rule]
RULE_UNSPECIFIED: Rule
RULE_LEVIATHAN: Rule
RULE_INVARIANT: Rule

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "tool_calls_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    tool_calls_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("lookahead", "disabled", "adaptive", "overlap", "rule", "tree_nodes", "cache", "history", "history_salt", "prediction")
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SALT_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    lookahead: int
    disabled: bool
    adaptive: bool
    overlap: bool
    rule: Rule
    tree_nodes: int
    cache: bool
    history: bool
    history_salt: str
    prediction: str
    def __init__(self, lookahead: _Optional[int] = ..., disabled: _Optional[bool] = ..., adaptive: _Optional[bool] = ..., overlap: _Optional[bool] = ..., rule: _Optional[_Union[Rule, str]] = ..., tree_nodes: _Optional[int] = ..., cache: _Optional[bool] = ..., history: _Optional[bool] = ..., history_salt: _Optional[str] = ..., prediction: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "token_ids", "chat_template", "sampling", "seed", "max_new_tokens", "stop_token_ids", "stop_strings", "speculation", "constraint", "logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    token_ids: TokenIds
    chat_template: bool
    sampling: _model_pb2.SamplingParams
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationParams
    constraint: _model_pb2.Constraint
    logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat_template: _Optional[bool] = ..., sampling: _Optional[_Union[_model_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., constraint: _Optional[_Union[_model_pb2.Constraint, _Mapping]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "token_bytes", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "tokens_per_second", "wall_seconds", "prompt_tokens", "generated_tokens", "draft_seconds", "target_seconds", "seed", "round_seconds", "draft_compute_seconds", "target_compute_seconds", "wire_bytes", "drafted_tokens", "draft_core_seconds", "target_core_seconds", "draft_forward_seconds", "target_forward_seconds", "rounds_without_draft", "cache_branches", "cache_hits", "draft_mask_seconds", "target_mask_seconds", "lookahead", "proposals", "index_proposals")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_CORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_WITHOUT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    CACHE_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    INDEX_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    tokens_per_second: float
    wall_seconds: float
    prompt_tokens: int
    generated_tokens: int
    draft_seconds: float
    target_seconds: float
    seed: int
    round_seconds: float
    draft_compute_seconds: float
    target_compute_seconds: float
    wire_bytes: int
    drafted_tokens: int
    draft_core_seconds: float
    target_core_seconds: float
    draft_forward_seconds: float
    target_forward_seconds: float
    rounds_without_draft: int
    cache_branches: int
    cache_hits: int
    draft_mask_seconds: float
    target_mask_seconds: float
    lookahead: int
    proposals: int
    index_proposals: int
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., target_seconds: _Optional[float] = ..., seed: _Optional[int] = ..., round_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ..., target_compute_seconds: _Optional[float] = ..., wire_bytes: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., draft_core_seconds: _Optional[float] = ..., target_core_seconds: _Optional[float] = ..., draft_forward_seconds: _Optional[float] = ..., target_forward_seconds: _Optional[float] = ..., rounds_without_draft: _Optional[int] = ..., cache_branches: _Optional[int] = ..., cache_hits: _Optional[int] = ..., draft_mask_seconds: _Optional[float] = ..., target_mask_seconds: _Optional[float] = ..., lookahead: _Optional[int] = ..., proposals: _Optional[int] = ..., index_proposals: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TextSpan(_message.Message):
    __slots__ = ("length", "drafted")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    length: int
    drafted: bool
    def __init__(self, length: _Optional[int] = ..., drafted: _Optional[bool] = ...) -> None: ...

class RoundCounts(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "spans", "rounds", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerateStats
    spans: _containers.RepeatedCompositeFieldContainer[TextSpan]
    rounds: RoundCounts
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., spans: _Optional[_Iterable[_Union[TextSpan, _Mapping]]] = ..., rounds: _Optional[_Union[RoundCounts, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("role", "address", "available", "reason", "seconds", "losses")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    available: bool
    reason: str
    seconds: float
    losses: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., available: _Optional[bool] = ..., reason: _Optional[str] = ..., seconds: _Optional[float] = ..., losses: _Optional[int] = ...) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("status", "model_name", "draft", "target", "running", "max_concurrent", "queued", "max_queue", "refused", "pricing")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PRICING_FIELD_NUMBER: _ClassVar[int]
    status: str
    model_name: str
    draft: ServiceStatus
    target: ServiceStatus
    running: int
    max_concurrent: int
    queued: int
    max_queue: int
    refused: int
    pricing: Pricing
    def __init__(self, status: _Optional[str] = ..., model_name: _Optional[str] = ..., draft: _Optional[_Union[ServiceStatus, _Mapping]] = ..., target: _Optional[_Union[ServiceStatus, _Mapping]] = ..., running: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., queued: _Optional[int] = ..., max_queue: _Optional[int] = ..., refused: _Optional[int] = ..., pricing: _Optional[_Union[Pricing, _Mapping]] = ...) -> None: ...

class Pricing(_message.Message):
    __slots__ = ("lookahead", "overlapped", "acceptance", "draft_token_seconds", "verify_seconds", "plain_token_seconds", "speedup", "timed", "plain_alone", "carried_over")
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    TIMED_FIELD_NUMBER: _ClassVar[int]
    PLAIN_ALONE_FIELD_NUMBER: _ClassVar[int]
    CARRIED_OVER_FIELD_NUMBER: _ClassVar[int]
    lookahead: int
    overlapped: bool
    acceptance: float
    draft_token_seconds: float
    verify_seconds: float
    plain_token_seconds: float
    speedup: float
    timed: float
    plain_alone: bool
    carried_over: bool
    def __init__(self, lookahead: _Optional[int] = ..., overlapped: _Optional[bool] = ..., acceptance: _Optional[float] = ..., draft_token_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., plain_token_seconds: _Optional[float] = ..., speedup: _Optional[float] = ..., timed: _Optional[float] = ..., plain_alone: _Optional[bool] = ..., carried_over: _Optional[bool] = ...) -> None: ...
