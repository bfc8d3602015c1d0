"""Seismic data in and out: SEG-Y, MDIO, zarr, in-memory arrays, output identity and atomic files.

Imports only :mod:`memchunk_prefect.core` from the package.
"""
