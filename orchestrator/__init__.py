"""The orchestrator: the accept/resample loop across the two services, and the client API."""

# The sampling rules (specdec.decoding.rule, orchestrator.loop); here, so the CLI lists them without torch.
# leviathan: a seed reproduces the text for a fixed lookahead; invariant: for any schedule at all.
RULES = ("leviathan", "invariant")
# Greedy tokens an orchestrator generates at start to price its pair (orchestrator.calibration):
# 3-6 s on the default pair on two CPU cores, then as many again each way to time speculation
# against plain rounds (orchestrator.calibration.alone_gain). Here, so the CLI shows the default without torch.
CALIBRATION_TOKENS = 120
# Seconds between writes of an orchestrator's prices to their store while it serves
# (orchestrator.calibration.KeptPrices; deploy.configs.OrchestratorConfig.prices_every).
KEEP_PRICES_EVERY = 60.0
