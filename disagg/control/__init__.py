"""gRPC control plane: coordinator service, client, and `disagg ctl`. The only package that imports grpc."""
