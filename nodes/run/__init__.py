"""One sampling run: its state and stores, the wrappers that bracket it, the host's services, reuse."""
