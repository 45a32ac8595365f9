"""VQ-VAE models for softvq: convolutional encoder/decoder and a LightningModule around any softvq quantizer, and an
autoregressive transformer prior over the VQ-VAE's code grids."""

from softvq.models.autoencoder import Decoder, Encoder, ResidualBlock, ResidualStack
from softvq.models.prior import CodePrior, VQVAERecord, check_pairing, evaluate_prior, load_prior
from softvq.models.transformer import CodeTransformer, PriorConfig
from softvq.models.vqvae import QUANTIZERS, RESIDUAL_QUANTIZERS, VQVAE, VQVAEOutput, build_quantizer, load_vqvae

__all__ = ["QUANTIZERS", "RESIDUAL_QUANTIZERS", "VQVAE", "CodePrior", "CodeTransformer", "Decoder", "Encoder",
           "PriorConfig", "ResidualBlock", "ResidualStack", "VQVAEOutput", "VQVAERecord", "build_quantizer",
           "check_pairing", "evaluate_prior", "load_prior", "load_vqvae"]
