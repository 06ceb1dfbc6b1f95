"""gRPC plumbing shared by the gateway and the workers: servers, clients, authentication with the
deployment secret."""
