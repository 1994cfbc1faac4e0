"""The box's update cycle: the A/B disk image, flashing it, updating a running box, the boot self-test.

An image is a directory:

    disk.raw        a GPT disk: ESP, root-a, root-b, data (`layout`, fixed for every build)
    manifest.json   name, version, signing key id and the sha256 of every region of disk.raw (`manifest`)
    manifest.sig    Ed25519 over the exact bytes of manifest.json (the firmware bundles' scheme and keys)

Booting is systemd-boot's: one Type #1 loader entry per slot on the ESP. A trial slot's entry carries a
boot counter (`slot-b+1.conf`); systemd-boot decrements it at boot and systemd-bless-boot drops it
once boot-complete.target is reached (the self-test passed). An entry with no tries left sorts
below every other, so the next boot takes the previous slot again. Entries sort by `version`
(highest first), which an update raises by one.

Modules, in the order an image lives through them:

    layout      the partitions, their sizes and GUIDs, the loader entries
    disk        bytes of disks and image files: read and hash in blocks, write and sync, the disk tools
    manifest    the signed manifest of region hashes: sign, verify
    assemble    disk.raw from the root and data file systems (the build host)
    flash       a verified image onto a block device or file, read back
    slots       the running box's slots: which one booted, writing the inactive one on trial
    units       the systemd units an update restarts, and reboots
    selftest    the boot self-test: a real inference over the Unix socket; it commits firmware on trial
    update      `appliance update` (an image or a firmware bundle), `firmware rollback`
    recover     `appliance recover`, after a failed self-test
"""
