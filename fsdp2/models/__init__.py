"""Small reference models used by the example, the benchmarks and the tests."""

from fsdp2.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
