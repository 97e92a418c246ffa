"""Model definitions (Llama, DeepSeek-V2/V3) and weight loading."""
