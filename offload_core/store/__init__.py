"""The store: one prefix put once and got many times (`kvstore`), its plan, layers, ring of device slots and codec."""
