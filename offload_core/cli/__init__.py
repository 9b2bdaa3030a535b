"""The command line's shared argument checks and the demo."""
