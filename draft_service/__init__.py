"""The draft service: a small model that proposes k tokens per round over gRPC."""

# The drafters a draft service can run (draft_service.drafters); here, so the CLI lists them without torch.
METHODS = ("model", "ngram", "llamacpp")
