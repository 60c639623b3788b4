"""The forkpoint command line."""
