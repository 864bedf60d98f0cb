"""Generated gRPC stubs (sdk/generate_stubs.py); do not edit."""
