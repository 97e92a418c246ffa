"""Building blocks shared by the models: linears, attention, MLA, MoE, RoPE, norms."""
