"""Drafter service: a ``tandem.drafters`` drafter behind ``tandem.v1.Drafter``."""
