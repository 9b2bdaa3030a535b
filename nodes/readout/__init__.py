"""The memory readout: the telemetry hub, its figures, the monitor node and the route."""
