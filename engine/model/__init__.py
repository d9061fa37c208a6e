"""The Clover architecture: config, the layers (Gated DeltaNet, attention, MoE), the expert banks."""
