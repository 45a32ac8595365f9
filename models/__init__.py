"""VQ-VAE models for softvq: convolutional encoder/decoder and a LightningModule around any softvq quantizer."""

from models.autoencoder import Decoder, Encoder, ResidualBlock, ResidualStack
from models.vqvae import QUANTIZERS, VQVAE, VQVAEOutput, build_quantizer, load_vqvae

__all__ = ["QUANTIZERS", "VQVAE", "Decoder", "Encoder", "ResidualBlock", "ResidualStack", "VQVAEOutput",
           "build_quantizer", "load_vqvae"]
