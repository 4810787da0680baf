"""The draft service: a small model that proposes k tokens per round over gRPC."""

# The drafters a draft service can run (draft_service.drafters); here, so the CLI lists them without torch.
# "auto": llamacpp for the embedded default pair's draft when llama-cpp-python is installed, else model.
# "suffix": model-free, over the session's and recent sessions' tokens; "hybrid": it beside auto's model.
METHODS = ("auto", "model", "ngram", "llamacpp", "suffix", "hybrid")
