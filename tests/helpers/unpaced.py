"""Tests that need every chunk of a save encoded, whatever the machine's load."""


def encode_every_chunk(repo):
    """Have `repo`'s saves encode every chunk (its stores no longer pace encoding); return it."""
    for store in repo.stores:
        store.paces_encoding = False
    return repo
