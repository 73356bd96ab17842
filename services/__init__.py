"""Tandem services: drafter, verifier and router over gRPC (and as Ray Serve deployments).

Services are thin: they translate protobuf to ``tandem``'s dataclasses and back; every
algorithm lives in ``tandem/``.
"""
