// Built with every object of xfbench_report and only the cards and measurement libraries
// (CMakeLists.txt): it links exactly when the report layer needs no mechanism.
int main() { return 0; }
