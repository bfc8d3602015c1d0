"""What is learned, and where it is kept: the operators' memory, time and energy models, and the store.

Imports only :mod:`memchunk_prefect.core` from the package.
"""
