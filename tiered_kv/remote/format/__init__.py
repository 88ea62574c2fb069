"""What the shared tier's bucket holds: object keys and the self-describing object
format (``object_format``), the fleet key and the per-object AEAD (``keys``), and bounded
parsing of the small JSON records anyone may have written (``safe_json``). Pure
functions and key loading; used by every process that reads or writes the tier."""
