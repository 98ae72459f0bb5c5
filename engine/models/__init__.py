"""Native model implementations (Llama family) with HF parameter names."""
