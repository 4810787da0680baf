"""The draft service: a small model that proposes k tokens per round over gRPC."""

# The drafters a draft service can run (draft_service.drafters); here, so the CLI lists them without torch.
# "suffix": model-free, over the session's and recent sessions' tokens; "hybrid": it beside a model draft
# (llamacpp for the embedded default and GGUF files when llama-cpp-python is installed, else model);
# "auto": the hybrid.
METHODS = ("auto", "model", "ngram", "llamacpp", "suffix", "hybrid")
