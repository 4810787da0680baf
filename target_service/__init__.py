"""The target service: the large model that scores a block of draft tokens in one forward pass."""
