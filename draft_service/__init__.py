"""The draft service: a small model that proposes k tokens per round over gRPC."""
