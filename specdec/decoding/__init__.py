"""What a token is drawn from, identical on the draft and the target: the speculative sampling
rule (rule), logits to probabilities (sampling), penalties and biases as functions of the
sequence (penalties), and structured output's grammar masks (grammar). Pure functions and small
value types: no model, no KV cache, no RPC."""
