"""systemd and D-Bus services: sd_notify and socket activation, unit drains, reboots through logind, early SIGHUP."""
