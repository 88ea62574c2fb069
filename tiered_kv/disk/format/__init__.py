"""The disk tier's on-disk format, read and written by every process that opens a cache
directory (scheduler, workers, the inspector): namespaces and their manifests, slab
files, the writer lock, the LMDB index and its records, and the safe opening of every
entry."""
