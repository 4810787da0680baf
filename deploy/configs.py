"""What deploy builds, as frozen configs: a model service and an orchestrator.

Shared by deploy.hosting (which builds them), deploy.ray_deploy and the command line. Light
on purpose (no torch): the CLI and a Ray driver import it to describe what runs elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service import METHODS as DRAFTERS
from orchestrator import CALIBRATION_TOKENS, KEEP_PRICES_EVERY, RULES
from specdec.limits import AdmissionLimits, RecoveryConfig, SessionLimits
from specdec.validation import MAX_LOOKAHEAD, MAX_TREE_NODES
from specdec.weights.models import ALIASES, DEFAULT_ALIAS, DERIVED_ALIASES, ModelSpec, llamacpp_installed

ROLES = ("draft", "target")
BACKENDS = ("auto", "torch", "llamacpp")  # what runs a target model (target_runtime, deploy.hosting.target_backend)


def target_runtime(spec: ModelSpec, backend: str = "auto") -> str:
    """What runs a target model: `backend`, or for `auto` the engine that is fastest where it
    runs: llama.cpp for a .gguf file, and for the embedded default in float32 on a CPU (its F32
    GGUF holds the same weights; llama.cpp decodes it ~3x faster than transformers there, and
    batches it), where llama-cpp-python is installed; transformers for anything else (a hub id or
    local path, another dtype, a CUDA device, the grown and rounded aliases)."""
    if backend != "auto":
        return backend
    if spec.model.endswith(".gguf"):
        return "llamacpp"
    default = spec.model in ALIASES and spec.device == "cpu" and spec.dtype == "float32"
    return "llamacpp" if default and llamacpp_installed() else "torch"


@dataclass(frozen=True)
class ModelServiceConfig:
    """What a model service is: its role, its model, how it drafts, what it holds at most."""

    role: str  # "draft" or "target"
    spec: ModelSpec = field(default_factory=ModelSpec)
    drafter: str = "auto"  # draft only: a method of draft_service.drafters
    limits: SessionLimits = field(default_factory=SessionLimits)
    cpus: tuple[int, ...] | None = None  # the cores it may use (CPU affinity); None: as started
    threads: int | None = None  # threads of its forwards; None: one per core it may use
    # Target only: "torch" (transformers), "llamacpp" (a GGUF run by llama.cpp; the default alias
    # runs its F32 requantisation) or "auto" (target_runtime: llama.cpp for the default alias on a
    # CPU, transformers otherwise). A target model that is a .gguf file implies llamacpp.
    backend: str = "auto"
    # A transformers model's decode and verify forwards as CUDA graphs, captured at start over a KV
    # cache allocated once from limits (specdec.runtime.graphs); None: on for CUDA. CUDA only.
    compile: bool | None = None

    def __post_init__(self):
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.role == "draft" and self.backend not in ("auto", "torch"):
            raise ValueError("backend is the target's; a draft service picks its runtime with drafter")
        if self.compile and not self.spec.device.startswith("cuda"):
            raise ValueError(
                f"--compile captures CUDA graphs: it needs a CUDA device, not {self.spec.device!r} (a CPU serves eager)"
            )
        if self.role == "target" and self.spec.model.endswith(".gguf"):
            object.__setattr__(self, "backend", "llamacpp")  # only llama.cpp runs a GGUF file
        self._check_backend()

    @property
    def runtime(self) -> str:
        """What runs the model: "torch" or "llamacpp" (a target's backend, `auto` resolved here)."""
        return target_runtime(self.spec, self.backend) if self.role == "target" else "torch"

    def _check_backend(self) -> None:
        if self.backend == "llamacpp" and self.spec.model in DERIVED_ALIASES:
            raise ValueError(
                f"{self.spec.model!r} is built from the embedded model for transformers; llama.cpp has no "
                f"GGUF of it: run it with backend torch, or llamacpp with '{DEFAULT_ALIAS}'"
            )
        if self.backend == "llamacpp" and self.spec.model not in ALIASES and not self.spec.model.endswith(".gguf"):
            raise ValueError(
                f"the llamacpp target backend runs a .gguf file or '{DEFAULT_ALIAS}', not {self.spec.model!r} "
                "(a transformers model: backend torch)"
            )


@dataclass(frozen=True)
class OrchestratorConfig:
    """What the orchestrator admits and how it waits for a lost service."""

    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    connect_seconds: float = 60.0  # how long startup waits for each service to answer
    # overlapped rounds for requests that leave speculation.overlap unset; None: by placement (sequential
    # where the two services share one accelerator, orchestrator.generation.default_overlap)
    overlap: bool | None = None
    speculation_cache: bool = True  # the speculation cache for requests that leave speculation.cache unset
    rule: str = "leviathan"  # the sampling rule of requests that leave speculation.rule unset (RULES)
    tree_nodes: int = 0  # draft trees for requests that leave speculation.tree_nodes unset; 0: chains
    # k (adaptive: the largest) for requests that leave speculation.lookahead unset; None: measured
    # (orchestrator.generation.default_lookahead)
    lookahead: int | None = None
    adaptive: bool = False  # adaptive lookahead for requests that leave speculation.adaptive unset
    http_port: int | None = None  # the OpenAI-compatible HTTP API on the orchestrator's host; 0: a free port
    # greedy tokens generated at start to price the pair before its first request (orchestrator.calibration); 0: none
    calibration_tokens: int = CALIBRATION_TOKENS
    # a Unix socket's path where the orchestrator also answers health checks, and only those: a
    # supervisor's probes past its TLS (deploy.local); None: none
    health_socket: str | None = None
    # where the pair's prices are kept: read at start where a predecessor on this pair wrote them
    # (no calibration), written after it (orchestrator.calibration.priced_once); None: calibrated each start
    prices_file: str | None = None
    # seconds between writes of the prices while it serves (in-service refinements kept; a store
    # that lost them has them back); 0: written after the start's calibration only
    prices_every: float = KEEP_PRICES_EVERY

    def __post_init__(self):
        if self.calibration_tokens < 0:
            raise ValueError(f"--calibration-tokens must be >= 0, got {self.calibration_tokens}")
        if self.prices_every < 0:
            raise ValueError(f"prices_every must be >= 0 seconds, got {self.prices_every}")
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}: choose one of {', '.join(RULES)}")
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"--tree must be in 0..{MAX_TREE_NODES}, got {self.tree_nodes}")
        if self.lookahead is not None and not 1 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"--lookahead must be in 1..{MAX_LOOKAHEAD}, got {self.lookahead}")
