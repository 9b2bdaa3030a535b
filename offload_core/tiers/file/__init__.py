"""The file tier: layers in checksummed files, written and read in the background, owned by a locked directory."""
