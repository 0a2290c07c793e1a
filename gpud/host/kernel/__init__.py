"""The kernel's interfaces: PCI sysfs and its deadline-bound writes, /proc holders, /dev/kmsg, udev events."""
