"""Verifier service: the target model behind ``tandem.v1.Verifier``."""
