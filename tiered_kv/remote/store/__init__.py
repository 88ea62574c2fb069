"""The shared tier's block store and its clients: ``RemoteStore`` (``store``) over an
``ObjectClient`` per backend (``client`` for S3, ``mooncake_client``, chosen by
``backends``; timed by ``timed_client``), write-once puts (``write_once``), upload
outcomes and counters (``outcomes``) and fault accounting (``health``). Runs in every
process that opens the tier: the workers, the scheduler (probes, checks) and the tools."""
