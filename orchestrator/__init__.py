"""The orchestrator: the accept/resample loop across the two services, and the client API."""

# The sampling rules (specdec.rule, orchestrator.loop); here, so the CLI lists them without torch.
# leviathan: a seed reproduces the text for a fixed lookahead; invariant: for any schedule at all.
RULES = ("leviathan", "invariant")
