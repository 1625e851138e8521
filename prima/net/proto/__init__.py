"""Generated protobuf and gRPC modules for prima.v1 (see protos/generate.py)."""
