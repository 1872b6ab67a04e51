"""The gRPC and HTTP servers over a real broker: calls, auth, the console, metrics, the serve process."""
