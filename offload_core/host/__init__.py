"""What the host gives the engine: host memory (pinned and pageable buffers), devices and streams, free-memory facts, environment knobs."""
