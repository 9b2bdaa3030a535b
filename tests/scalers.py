"""Attention functions held as a partial or as a callable object, as attention-patching packages install them:
a change to the partial's arguments or to the object's `factor` is a change to the values a forward reads."""


def scaled(original, factor, *args, **kwargs):
    return original(*args, **kwargs) * factor


class Scaler:
    """A callable object whose `factor` is state its `__call__` reads."""

    def __init__(self, fn, factor):
        self.fn, self.factor = fn, factor

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs) * self.factor
