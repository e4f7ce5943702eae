python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KBIT_NUMBA_CACHE_DIR=/tmp/kc
M="gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_op_ldgsts.sum,sm__warps_active.avg.pct_of_peak_sustained_active"
for s in 5120x2048:16 2048x4096:16; do sh=${s%:*}; m=${s#*:}; for lay in tiled codes; do
 f=$OUT/ncu_${sh}_m${m}_$lay.txt
 timeout 100 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --metrics $M -k regex:gemm_kernel -s 2 -c 1 python benchmarks/profile_gemm.py ${sh%x*} ${sh#*x} 4 $m $lay > $f 2>&1
 echo "== $sh M=$m $lay"; grep -E "registers|Duration|gpu__time|inst_executed|dram__bytes|lts__t_sectors|l1tex__t_|bank_conflicts|ldgsts|warps_active|Stall|Warp Cycles Per Issued|Issued Warp|Achieved Occupancy|Block Limit|Memory Throughput|Grid Size|Waves" $f | head -40
done; done
