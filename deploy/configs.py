"""What deploy builds, as frozen configs: a model service and an orchestrator.

Shared by deploy.hosting (which builds them), deploy.ray_deploy and the command line. Light
on purpose (no torch): the CLI and a Ray driver import it to describe what runs elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service import METHODS as DRAFTERS
from orchestrator import RULES
from specdec.limits import AdmissionLimits, RecoveryConfig, SessionLimits
from specdec.models import ALIASES, DEFAULT_ALIAS, DERIVED_ALIASES, ModelSpec
from specdec.validation import MAX_TREE_NODES

ROLES = ("draft", "target")
BACKENDS = ("torch", "llamacpp")  # what runs a target model (deploy.hosting.target_backend)


@dataclass(frozen=True)
class ModelServiceConfig:
    """What a model service is: its role, its model, how it drafts, what it holds at most."""

    role: str  # "draft" or "target"
    spec: ModelSpec = field(default_factory=ModelSpec)
    drafter: str = "auto"  # draft only: a method of draft_service.drafters
    limits: SessionLimits = field(default_factory=SessionLimits)
    cpus: tuple[int, ...] | None = None  # the cores it may use (CPU affinity); None: as started
    threads: int | None = None  # threads of its forwards; None: one per core it may use
    # Target only: "torch" (transformers) or "llamacpp" (a GGUF run by llama.cpp; the default alias
    # runs its F32 requantisation). A target model that is a .gguf file implies llamacpp.
    backend: str = "torch"
    # A transformers model's decode and verify forwards as CUDA graphs, captured at start over a KV
    # cache allocated once from limits (specdec.graphs); None: on for CUDA. CUDA only.
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
        if self.role == "draft" and self.backend != "torch":
            raise ValueError("backend is the target's; a draft service picks its runtime with drafter")
        if self.compile and not self.spec.device.startswith("cuda"):
            raise ValueError(
                f"--compile captures CUDA graphs: it needs a CUDA device, not {self.spec.device!r} (a CPU serves eager)"
            )
        if self.role == "target" and self.spec.model.endswith(".gguf"):
            object.__setattr__(self, "backend", "llamacpp")  # only llama.cpp runs a GGUF file
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
    overlap: bool = True  # overlapped rounds for requests that leave speculation.overlap unset
    speculation_cache: bool = True  # the speculation cache for requests that leave speculation.cache unset
    rule: str = "leviathan"  # the sampling rule of requests that leave speculation.rule unset (RULES)
    tree_nodes: int = 0  # draft trees for requests that leave speculation.tree_nodes unset; 0: chains
    http_port: int | None = None  # the OpenAI-compatible HTTP API on the orchestrator's host; 0: a free port

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}: choose one of {', '.join(RULES)}")
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"--tree must be in 0..{MAX_TREE_NODES}, got {self.tree_nodes}")
