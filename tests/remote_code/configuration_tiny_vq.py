"""Configuration of a tiny VQ video tokenizer shipped as custom code (loaded with trust_remote_code=True)."""
from transformers import PretrainedConfig


class TinyVQConfig(PretrainedConfig):
    model_type = "zb_tiny_vq"

    def __init__(
        self,
        in_channels: int = 3,
        hidden_channels: int = 8,
        embed_dim: int = 4,
        codebook_size: int = 16,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.in_channels = in_channels
        self.hidden_channels = hidden_channels
        self.embed_dim = embed_dim
        self.codebook_size = codebook_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)
