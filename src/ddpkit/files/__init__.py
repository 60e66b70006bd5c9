"""Files a run leaves on disk, and who may write them.

``durable.py`` writes every file so that a crash or a full disk never leaves half of it
(a hidden temporary beside the destination, fsynced, renamed into place; a full disk is
a ``DiskFullError`` naming the file); ``jsonfiles.py`` keeps NaN and infinity out of
JSON so that any reader can parse it; ``run_lock.py`` lets one job at a time write into
a run directory and names the holder to the one refused. torch-free, so the launcher
uses them before any worker starts.
"""
