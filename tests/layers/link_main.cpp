// main() for the build's link checks (CMakeLists.txt, sigma_layer): each layer's whole archive
// is linked with only the layers it uses, so a call into any other layer is an undefined
// reference and fails the build.
int main() { return 0; }
