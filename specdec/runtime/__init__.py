"""A model service's engine: a causal LM behind one interface (backend: torch; llamacpp: GGUF;
standin: fixed-time forwards), the slot KV cache (kvcache), the per-session engine and the one
worker thread that touches the model (engine, worker), its warm-up and step timings before serving
(startup), static graphs and fused kernels (graphs, fusion), the prefix cache (prefix), the
architectures served exactly (architectures) and the cores a service uses (placement). It knows
nothing of gRPC (specdec.serving)."""
