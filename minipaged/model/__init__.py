"""The Llama forward pass on a paged KV cache (chapter 09)."""

from .attention import AttentionMetadata, PagedAttention
from .llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "PagedAttention"]
