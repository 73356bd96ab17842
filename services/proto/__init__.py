"""Generated gRPC stubs (``scripts/gen_proto.sh``; do not edit): ``services.proto.tandem.v1``."""
