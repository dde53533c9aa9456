"""lorapop: population-based self-play RL of LLMs on LoRA adapters sharing one frozen base."""

__version__ = "0.1.0"
