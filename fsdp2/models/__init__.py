"""Small reference models used by the examples, the benchmarks and the tests."""

from fsdp2.models.gpt import GPT, GPTConfig
from fsdp2.models.llama import Llama, LlamaConfig, tensor_parallel_plan

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "tensor_parallel_plan"]
