"""Native CPU kernels (C++, built at first use) with their portable torch references."""
